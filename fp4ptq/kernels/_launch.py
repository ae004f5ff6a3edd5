"""A Triton launch whose grid and compile-time arguments are fixed, replayed without Triton's per-call
work.

``kernel[grid](*args, **kwargs)`` costs about 33 us of host time a call on the H200 host (Triton 3.6,
``benchmarks/launch_probe_h200.py``): the argument binder and specialization (8 us), the kernel-cache
key, the knobs, device and stream queries, and the C launcher itself (8 us). An eager layer call pays
it for every kernel. ``Launch`` keeps what a replay needs after the second call of the same
specialization: the compiled kernel's launcher, its function handle and metadata, and the values of
the arguments that never change (the compile-time ones and the fixed run-time ones); later calls go
straight to the C launcher with the per-call tensors put in their places.

Soundness: a compiled kernel depends on its arguments' specialization (each tensor's dtype and
whether its address is a multiple of 16; each integer's value class: equal to 1, a multiple of 16,
its width). The fixed arguments are the ones it was captured with (held here, so they stay alive),
and the per-call slots must be tensors: a replay checks each one's dtype and 16-byte alignment
against the capture and takes Triton's own path on any difference, on another current device, or
while launch hooks (profilers) are installed.

Where the compiled kernel needs no scratch buffers, the replay calls the C launcher itself, past
the Python wrapper that would otherwise expand every TMA descriptor argument on each call
(``make_tensordesc_arg``: about 3 us each on the H200 host): fixed descriptors (a weight's) are
expanded once at capture, per-call ones once per address, shape and strides (a few kept).
``FP4PTQ_C_LAUNCH=0`` keeps the replay on Triton's Python launcher (measured on the H200: 8-12 us more
a call at 512 rows, ``benchmarks/prefill_host_h200.py``).

The replay uses Triton's launcher interface of the versions it was checked on (``FAST_VERSIONS``);
on others, under the interpreter, or with ``FP4PTQ_FAST_LAUNCH=0``, every call is Triton's own
launch. ``FP4PTQ_FAST_LAUNCH=1`` forces the replay on another version.
"""
from __future__ import annotations

import functools
import os
from typing import Optional, Sequence

import torch
import triton

FAST_VERSIONS = ("3.6.",)
FAST_LAUNCH = os.environ.get("FP4PTQ_FAST_LAUNCH", "auto")
if FAST_LAUNCH not in ("auto", "0", "1"):
    raise ValueError(f"FP4PTQ_FAST_LAUNCH={FAST_LAUNCH!r}: use auto (the checked Triton versions), 1 or 0")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# replays call the C launcher itself where they can ("0": through Triton's Python launcher, as before)
C_LAUNCH = os.environ.get("FP4PTQ_C_LAUNCH", "1") == "1"


def fast_launch_enabled() -> bool:
    """Whether launches may be replayed past Triton's binder here (see the module docstring)."""
    if INTERPRET or FAST_LAUNCH == "0":
        return False
    return FAST_LAUNCH == "1" or triton.__version__.startswith(FAST_VERSIONS)


def current_device() -> int:
    """The current CUDA device's index, without ``torch.cuda.current_device``'s Python checks (about
    1 us a call on the H200 host; a replay asks once a launch, and CUDA is initialized by then)."""
    return torch._C._cuda_getDevice()


@functools.lru_cache(maxsize=None)
def cuda_sm_count(index: int) -> int:
    """The SM count of GPU ``index`` (asked once per GPU: ``get_device_properties`` costs about 10 us a
    call on the H200 host)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


try:
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - an older Triton: no hook chains to look at
    _knobs = None


def _hooks_idle() -> bool:
    """No launch hooks installed (a profiler such as proton installs them; they need Triton's path)."""
    if _knobs is None:
        return True
    for hook in (_knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


DESC_CACHE = 16  # per-call TMA descriptors expanded and kept per Launch (by address, shape, strides)


def _c_launcher(run, positions: int):
    """(C launch function, cooperative, PDL, {kernel-argument position: TMA metadata}, expander) of a
    Triton 3.6 ``CudaLauncher`` whose kernel needs no scratch memory, or None (another launcher, a
    wrapper this code does not know, scratch buffers to allocate each call)."""
    try:
        if run.global_scratch_size or run.profile_scratch_size:
            return None
        launch, coop, pdl = run.launch, run.launch_cooperative_grid, run.launch_pdl
    except AttributeError:
        return None
    code = getattr(launch, "__code__", None)
    if code is None:  # the compiled C function itself: no descriptor arguments
        return launch, coop, pdl, {}, None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in launch.__closure__ or ())))
    expand = launch.__globals__.get("make_tensordesc_arg")
    if code.co_name != "inner" or set(cells) != {"launcher", "tensordesc_indices", "tensordesc_meta"} \
            or not callable(expand):
        return None
    indices = sorted(cells["tensordesc_indices"])
    metas = cells["tensordesc_meta"]
    if len(metas) != len(indices) or (indices and indices[-1] >= positions):
        return None
    return cells["launcher"], coop, pdl, dict(zip(indices, metas)), expand


class Launch:
    """``kernel[grid](*args, **kwargs)`` with ``args`` fixed except at the positions ``slots``, which
    each call fills, in order, with tensors: ``Launch(k, grid, args, slots, kwargs)(x, y)``.
    The first call of a specialization takes Triton's path; the second captures it; later ones
    replay it (see the module docstring)."""

    __slots__ = ("kernel", "grid", "args", "slots", "kwargs", "_seen", "_direct", "_c", "_descs")

    def __init__(self, kernel, grid: Sequence[int], args: Sequence, slots: Sequence[int], kwargs: dict):
        grid = tuple(int(g) for g in grid)
        self.kernel = kernel
        self.grid = grid + (1,) * (3 - len(grid))
        self.slots = tuple(slots)
        self.args = [None if i in self.slots else a for i, a in enumerate(args)]  # no per-call tensor kept
        self.kwargs = kwargs
        self._seen = None    # the slots' (dtype, aligned) of the last call through Triton's path
        self._direct = None  # (launcher, function, metadata, device, slot specs, tail values) or False
        self._c = None       # the C launcher's call: (function, head, flat arguments, slot places) or None
        self._descs = {}     # per-call TMA descriptors expanded for the C launcher

    @staticmethod
    def _spec(tensors) -> tuple:
        """Per slot: a tensor's dtype and 16-byte alignment; for a TMA descriptor (built by the caller
        with a fixed block shape and layout), its type and its base tensor's."""
        spec = []
        for t in tensors:
            if isinstance(t, torch.Tensor):
                spec.append((t.dtype, t.data_ptr() % 16 == 0))
            else:
                base = t.base
                spec.append((type(t), base.dtype, base.data_ptr() % 16 == 0))
        return tuple(spec)

    def __call__(self, *tensors: torch.Tensor) -> None:
        direct = self._direct
        if direct:
            run, function, metadata, device, spec, tail = direct
            if current_device() == device and self._spec(tensors) == spec and _hooks_idle():
                c = self._c
                if c is not None:
                    self._c_call(c, device, tensors)
                    return
                args = self.args.copy()  # (a copy: calls from two threads do not share it)
                for i, t in zip(self.slots, tensors):
                    args[i] = t
                g = self.grid
                run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(device), function, metadata,
                    None, None, None, *args, *tail)
                return
        args = list(self.args)
        for i, t in zip(self.slots, tensors):
            args[i] = t
        compiled = self.kernel[self.grid](*args, **self.kwargs)
        if not fast_launch_enabled() or compiled is None:
            return
        spec = self._spec(tensors)
        if self._seen == spec and direct is None:
            self._direct = self._capture(compiled, args, spec) or False  # False: not replayable here
            if self._direct:
                self._c = self._c_capture(args)
        self._seen = spec

    def _c_capture(self, args: list) -> Optional[tuple]:
        """The C launcher's call for this capture: its fixed leading arguments, the kernel arguments
        flattened as the Python wrapper would (descriptors expanded), and where each slot goes."""
        run, function, metadata, _, _, tail = self._direct
        values = list(args) + list(tail)
        c = _c_launcher(run, len(values)) if C_LAUNCH else None
        if c is None:
            return None
        launch, coop, pdl, descs, expand = c
        flat, places = [], {}
        try:
            for i, v in enumerate(values):
                if i in descs:
                    parts = expand(v, descs[i])
                    if i in self.slots:
                        if descs[i] is None:  # an expansion holding the tensor itself: not kept
                            return None
                        places[i] = (len(flat), len(parts), descs[i])
                        parts = [None] * len(parts)
                    flat.extend(parts)
                else:
                    if i in self.slots:
                        places[i] = (len(flat), 0, None)
                        v = None
                    flat.append(v)
        except Exception:  # noqa: BLE001 - a descriptor this Triton expands differently: keep its wrapper
            return None
        head = (function, coop, pdl, None, None, metadata, None, None, None)
        return launch, head, flat, [places[i] for i in self.slots], expand

    def _c_call(self, c: tuple, device: int, tensors) -> None:
        launch, head, flat, places, expand = c
        flat = flat.copy()
        for (at, width, meta), t in zip(places, tensors):
            if width == 0:
                flat[at] = t
                continue
            key = (t.base.data_ptr(), tuple(t.shape), tuple(t.strides), t.padding)
            parts = self._descs.get(key)
            if parts is None:
                if len(self._descs) >= DESC_CACHE:
                    self._descs.clear()
                parts = self._descs[key] = expand(t, meta)
            flat[at:at + width] = parts
        g = self.grid
        launch(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(device), *head, *flat)

    def _capture(self, compiled, args: list, spec: tuple) -> Optional[tuple]:
        """The replay state of a kernel just launched by Triton with ``args`` (None where this Triton's
        internals are not the ones the replay was written for)."""
        try:
            device = current_device()
            binder = self.kernel.device_caches[device][4]
            params, _, _ = binder(*args, **self.kwargs)
            values = list(params.values())
            if len(values) < len(args) or any(v is not a for v, a in zip(values, args)):
                return None
            run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
        except Exception:  # noqa: BLE001 - internals that moved: keep Triton's path
            return None
        if function is None or not callable(run):
            return None
        return run, function, metadata, device, spec, tuple(values[len(args):])

    @property
    def replaying(self) -> bool:
        """Whether calls now go straight to the captured launcher."""
        return bool(self._direct)
