"""Deferred registration of the transformers hook (``fp4ptq/hf.py``).

Importing transformers' quantizer table costs seconds, so ``import fp4ptq``
does not do it: when the table is already imported the hook registers at
once; otherwise a one-shot import finder registers it right after
``transformers.quantizers.auto`` finishes loading (which every
``from_pretrained`` does first). Only the standard library is imported here.
"""
from __future__ import annotations

import importlib
import importlib.abc
import sys

TARGET = "transformers.quantizers.auto"


def _register_now() -> None:
    hf = sys.modules.get("fp4ptq.hf")
    if hf is not None and not hasattr(hf, "register"):
        # fp4ptq.hf is being imported (it imports the table at its top): it registers at its own end.
        return
    importlib.import_module("fp4ptq.hf").register()


class _RegisteringLoader(importlib.abc.Loader):
    """Runs the real loader, then registers the hook."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        _register_now()


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]  # one shot
        for finder in sys.meta_path:
            spec = getattr(finder, "find_spec", lambda *a: None)(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


def install() -> None:
    """Register now if transformers' quantizer table is loaded, else on its import."""
    if TARGET in sys.modules:
        _register_now()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
